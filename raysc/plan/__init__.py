"""The layout planner (``raysc plan``): enumerate, estimate, rank and profile parallel layouts."""
