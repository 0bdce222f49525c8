"""plan: lower(job, rank) -> RankPlan, plan files, and the cross-rank checker."""
