"""Fleet-wide tools: how evenly an area is spread (balance), what does not belong (fsck), and
how to even it out (rebalance). Each one reads shards through the Store and its router, the
same routing the application uses, and streams briefcase keys so memory stays bounded."""
