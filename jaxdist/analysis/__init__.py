"""Compile and measure: the train step's bytes and collectives (measure.py), the planner's inputs
read from a compiled step (plan_check.py), the benchmark table (bench_table.py)."""
