"""The control plane: deployments of registry packages, and the replicas that serve them."""
