"""Reward functions: rule scorers (reasoning-gym) now; GenRM and reward models plug in here."""
