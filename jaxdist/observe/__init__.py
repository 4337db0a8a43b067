"""What a run tells the person watching: per-step progress, metrics writer and MFU, trackers,
start-up and closing report, profiler traces, one-line warnings."""
