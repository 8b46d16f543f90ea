"""``ShardTensor`` and what moves it between layouts: constructors, redistribution, partial sums, and the
cross-rank checks of layouts and parameters that each rank declares alone."""
