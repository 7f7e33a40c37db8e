"""Tuning: compile the schedule's top-k candidates of each group, time them on a device,
check them against the interpreter, and keep the winners in the persistent tuning cache
(``tuner.py``, ``cache.py``).  It sits above code generation and reaches the GPU only
through the ``Device`` protocol that ``welder.device`` implements."""
