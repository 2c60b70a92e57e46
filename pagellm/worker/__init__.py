"""Model runner and its persistent input batch."""
