"""trainer: the DFlash block-diffusion drafter trainer."""
