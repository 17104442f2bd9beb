"""Everything effitrain prints or writes for the user, computing nothing: the commands hand over
the plain records of :mod:`effitrain.results`.

:mod:`~effitrain.report.live` is a run's :class:`~effitrain.report.live.Reporter` (banner,
progress, closing summary); :mod:`~effitrain.report.memory_tables` the memory tables a run ends
with (``inspect-state`` shows its ledger too); :mod:`~effitrain.report.estimate_tables`,
:mod:`~effitrain.report.comparison_table`, :mod:`~effitrain.report.plan_table` and
:mod:`~effitrain.report.state_tables` each command's results; :mod:`~effitrain.report.metrics_json`
the ``--metrics-json`` file.
"""
