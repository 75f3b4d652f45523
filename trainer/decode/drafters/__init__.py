"""Per drafter kind, what its static proposer adds to the DFlash one (trainer/decode/static_draft.py): `dflash2.py`."""
