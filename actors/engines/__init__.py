"""Rollout engines behind one RolloutEngine protocol."""
