"""OpenAI's Files and Batch APIs: tenants upload JSONL files of requests, create batches over
them, and read the results back as files.

``services`` (writes) and ``selectors`` (reads) are the public API; ``views`` shapes them as
OpenAI does, and ``jsonl`` checks an input file line by line."""
