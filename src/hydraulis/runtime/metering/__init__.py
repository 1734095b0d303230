"""What a run measures of itself: profiles, timed rounds, the memory meter and the step's peak."""
