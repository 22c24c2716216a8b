"""rollout spec."""
