"""What the benchmarks, the studies and the tools share: the report header, the fit builder, the timers.

The scripts run as scripts (``python benchmarks/<name>.py``); ``benchmarks/`` is on ``sys.path`` (it is
the folder of a benchmark; a study or a tool adds it), so they import ``harness.<module>``; the kit itself
comes from the installed package. See docs/reports/README.md for what each report holds.
"""
