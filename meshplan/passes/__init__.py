"""passes: pure functions from a train-step Graph towards a Job."""
