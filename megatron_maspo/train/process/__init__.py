"""Process plumbing: torch.distributed set-up from the launcher's environment, stop signals, fault injection."""
