"""Actor side of specrl: rollout engines, the actor loop and the trajectory sender."""
