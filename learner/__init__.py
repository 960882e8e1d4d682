"""Learner side of specrl: receiver, buffer, losses, the training loop, checkpoints and publishing."""
