"""S3 tier: blocks as objects ``<prefix><hex>`` in a bucket of any S3-compatible endpoint.

boto3 is synchronous, so every call runs in a worker thread; large blocks go up in parts
(boto3's managed transfer). Any failure to reach the endpoint surfaces as ``TierUnavailable``
so callers keep serving from DRAM and NVMe; a missing object is ``BlockNotFound``.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import boto3
import botocore.config
import botocore.exceptions
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig

from halfmoon.storage.base import BlockNotFound, Buffer, StorageTier, TierUnavailable, TierUsage, check_key

T = TypeVar("T")
_MISSING = {"404", "NoSuchKey", "NotFound"}


@dataclass
class S3Config:
    endpoint_url: str
    bucket: str
    prefix: str = "kv/"
    access_key: str = "halfmoon"
    secret_key: str = "halfmoon"
    region: str = "us-east-1"
    capacity: int = 1 << 50
    multipart_threshold: int = 8 << 20
    multipart_chunksize: int = 8 << 20
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 30.0
    max_attempts: int = 2

    def __post_init__(self) -> None:
        if not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint_url must be http(s)://..., got {self.endpoint_url!r}")
        if not self.bucket:
            raise ValueError("bucket must not be empty")
        if self.prefix and not self.prefix.endswith("/"):
            raise ValueError(f"prefix must end with '/', got {self.prefix!r}")
        if self.multipart_chunksize < 5 << 20:
            raise ValueError("S3 multipart parts must be at least 5 MiB")


class S3Tier(StorageTier):
    def __init__(self, config: S3Config) -> None:
        self.config = config
        self._client = boto3.client(
            "s3",
            endpoint_url=config.endpoint_url,
            aws_access_key_id=config.access_key,
            aws_secret_access_key=config.secret_key,
            region_name=config.region,
            config=botocore.config.Config(
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                s3={"addressing_style": "path"},
            ),
        )
        self._transfer = TransferConfig(
            multipart_threshold=config.multipart_threshold,
            multipart_chunksize=config.multipart_chunksize,
            use_threads=True,
        )

    def _name(self, key: bytes) -> str:
        return self.config.prefix + check_key(key).hex()

    async def _call(self, fn: Callable[[], T], key: bytes | None = None) -> T:
        try:
            return await asyncio.to_thread(fn)
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            if key is not None and str(error.get("Code")) in _MISSING:
                raise BlockNotFound([key]) from None
            raise TierUnavailable(f"S3 {self.config.endpoint_url}: {error.get('Code')} {error.get('Message')}") from exc
        except (botocore.exceptions.BotoCoreError, S3UploadFailedError) as exc:
            raise TierUnavailable(f"S3 {self.config.endpoint_url}: {exc}") from exc

    async def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist yet."""

        def create() -> None:
            try:
                self._client.head_bucket(Bucket=self.config.bucket)
            except botocore.exceptions.ClientError:
                self._client.create_bucket(Bucket=self.config.bucket)

        await self._call(create)

    async def put(self, key: bytes, data: Buffer) -> None:
        name = self._name(key)
        body = io.BytesIO(data)  # NOTE: copies once; boto3 needs a seekable file object
        await self._call(lambda: self._client.upload_fileobj(body, self.config.bucket, name, Config=self._transfer))

    async def get(self, key: bytes) -> bytes:
        name, out = self._name(key), io.BytesIO()
        bucket = self.config.bucket
        await self._call(lambda: self._client.download_fileobj(bucket, name, out, Config=self._transfer), key)
        return out.getvalue()

    async def delete(self, key: bytes) -> bool:
        present = await self.contains(key)
        if present:
            name = self._name(key)
            await self._call(lambda: self._client.delete_object(Bucket=self.config.bucket, Key=name))
        return present

    async def contains(self, key: bytes) -> bool:
        name = self._name(key)
        try:
            await self._call(lambda: self._client.head_object(Bucket=self.config.bucket, Key=name), key)
        except BlockNotFound:
            return False
        return True

    def _objects(self) -> dict[bytes, int]:
        out = {}
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.config.bucket, Prefix=self.config.prefix
        )
        for page in pages:
            for obj in page.get("Contents", []):
                suffix = obj["Key"][len(self.config.prefix) :]
                try:
                    key = bytes.fromhex(suffix)
                except ValueError:
                    continue  # not a block of ours
                if len(key) == 32:
                    out[key] = obj["Size"]
        return out

    async def list(self) -> list[bytes]:
        return list(await self.sizes())

    async def sizes(self) -> dict[bytes, int]:
        return await self._call(self._objects)

    @property
    def capacity(self) -> int:
        return self.config.capacity

    async def usage(self) -> TierUsage:
        objects = await self.sizes()
        return TierUsage(sum(objects.values()), self.config.capacity, len(objects))

    async def close(self) -> None:
        self._client.close()
