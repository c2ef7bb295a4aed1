"""Placement of rollout, GenRM and training over rank groups (colocate, partial, disaggregated)."""
