"""Role workers built only on the contracts: any engine and rollout plugin works with them."""
