"""Each user's share of the disk: quota enforcement (btrfs qgroups, or measured) and usage (quota.py)."""
