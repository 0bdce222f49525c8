"""runtime: execute plans with torch kernels."""
