"""Evaluation: `evaluate` (many tasks × runs, every method, accuracy and d_NTP, the
correlation and cost tables, resumable, with plots) and `regress` (the regression tasks,
scored on generated numbers, echoes named). Built on the pipeline and the method registry."""
