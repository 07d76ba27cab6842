"""Training data: local text (text), shards streamed from object storage (stream), the fetch step that copies
models and tokenizers before training (fetch) and the S3 helpers they share (s3)."""
