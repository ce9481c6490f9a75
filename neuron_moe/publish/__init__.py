"""Publishing compiled artifacts (S3, integrity-checked) and pulling them back."""
