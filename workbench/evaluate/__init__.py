"""Evaluation: score a run (before, during, after training) or an endpoint on any task."""
