#!/bin/sh
# Offline variant of create-bucket.sh (infra/compose.offline.yml): the same idempotent bucket creation
# with SeaweedFS's own `weed shell` (in the s3 image), which talks to the master, not the S3 API.
set -eu
master=${S3_MASTER:-s3:9333}
tries=0
until echo "s3.bucket.list" | weed shell -master="$master" >/tmp/buckets 2>&1; do
  tries=$((tries + 1))
  if [ "$tries" -ge 60 ]; then
    echo "SeaweedFS master at $master not answering after 60 tries" >&2
    cat /tmp/buckets >&2
    exit 1
  fi
  sleep 1
done
if grep -qw "$S3_BUCKET" /tmp/buckets; then
  echo "bucket $S3_BUCKET exists"
else
  echo "s3.bucket.create -name $S3_BUCKET" | weed shell -master="$master"
  echo "s3.bucket.list" | weed shell -master="$master" | grep -qw "$S3_BUCKET"
  echo "bucket $S3_BUCKET created"
fi
