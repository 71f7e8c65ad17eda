"""The trainer behind ``zeroshard train`` (the command's flags: ``zeroshard.commands.train``).

``config`` (TrainConfig), ``job`` (the command's process and each rank's), ``launch``
(the local launcher) and ``early`` (the launcher started before the flags are checked),
and on every rank the loop in parts over one ``Run``: ``loop``
(set-up, the order of the parts, the end), ``resume``, ``step`` (the step, evaluation)
and ``save``; beside them the model (``hfmodel``), the data (``datasource``), the
output (``report``, ``board``, ``profile``), the checks before launch (``preflight``)
and an error told once (``failure``). ``granularity`` is the benchmark behind
``zeroshard bench granularity``.
"""
