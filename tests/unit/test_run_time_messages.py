"""What a new user is told once at run time: where task ids come from, and the fallbacks to a prompt hash."""

import logging

from trl_exreplay.replay import say_task_id_source


def test_the_task_id_source_and_its_fallbacks_are_said(caplog):
    with caplog.at_level(logging.WARNING, logger="trl_exreplay"):
        say_task_id_source([{"prompt": "a", "task_id": 1}], "task_id")
        say_task_id_source([{"prompt": "a", "taskid": 1}], "task_id")  # misspelled: the columns are listed
        say_task_id_source([{"prompt": "a", "task_id": 1}, {"prompt": "b", "task_id": None}], "task_id")
    first, second, third = (record.getMessage() for record in caplog.records)
    assert "task ids from the dataset's 'task_id' column" in first
    assert "no 'task_id' column" in second and "['prompt', 'taskid']" in second and "hash of its prompt" in second
    assert "1 of the first batch's 2 rows have no 'task_id' value" in third
