"""dgxmm."""
