#!/bin/sh
# Create the KVCache object tier's bucket if it is missing (idempotent); waits for the S3 API first.
set -eu
if [ -n "${S3_KEYS_FILE:-}" ]; then  # the keys `halfmoon secrets` generated (compose's secrets volume)
  set -a
  . "$S3_KEYS_FILE"
  set +a
fi
tries=0
until aws --endpoint-url "$S3_ENDPOINT" s3api list-buckets >/dev/null 2>&1; do
  tries=$((tries + 1))
  if [ "$tries" -ge 60 ]; then
    echo "S3 API at $S3_ENDPOINT not answering after 60 tries" >&2
    exit 1
  fi
  sleep 1
done
if aws --endpoint-url "$S3_ENDPOINT" s3api head-bucket --bucket "$S3_BUCKET" 2>/dev/null; then
  echo "bucket $S3_BUCKET exists"
else
  aws --endpoint-url "$S3_ENDPOINT" s3api create-bucket --bucket "$S3_BUCKET"
  echo "bucket $S3_BUCKET created"
fi
