"""rollout bench."""
