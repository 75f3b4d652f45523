"""Data: JSONL -> tokenized samples -> packed fixed-length rows -> anchors -> StaticBatch."""
