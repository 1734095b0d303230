"""The processes a job runs besides its own work: the fork server ranks start from, the forked workers a
proposal plans on, and signals during long work. Torch-free."""
