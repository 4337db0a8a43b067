"""Data-parallel gradient reduction: `registry` maps each `reduce.method` to what it brings."""
