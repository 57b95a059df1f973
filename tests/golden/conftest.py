"""The golden-data generator runs under einshard 0.2 (Python 3.12), by hand; pytest must not import it."""

collect_ignore = ["make_einshard02_golden.py"]
