"""lm-evaluation-harness on the sharded model: its model interface, the compiled programs, the task runs."""
