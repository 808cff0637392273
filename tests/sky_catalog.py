"""SkyPilot, offline, over a catalog made from skyspot's price snapshot.

`offline_skypilot(home)` is the setup of SkyPilot's own test suite (`tests/common_test_fixtures.py`,
fixture `enable_all_clouds`) narrowed to what its optimizer touches for AWS, GCP and Azure:

- the catalog CSVs are written where SkyPilot 0.14.1 reads them, `<home>/.sky/catalogs/v8/<cloud>/vms.csv`
  (`sky.catalog.common.get_catalog_path`; SkyPilot's suite checks in its own fixture CSVs). A file
  without `.sky/catalogs/v8/.meta/<file>.md5` counts as "modified by the user" and is never
  re-downloaded (`is_catalog_modified`), so nothing reaches the network;
- `azure/images.csv` is the skypilot-catalog's, rows as published (`AZURE_IMAGE_ROWS`): SkyPilot checks and
  sizes a `skypilot:` image tag through it (sky/clouds/azure.py `get_image_size`), which Azure ND candidates
  name (skyspot/clouds/azure.py AZURE_HPC_IMAGE);
- the enabled clouds are what `sky check` would have cached (no credentials exist here);
- AWS zone IDs map to zone names as for an account: SkyPilot's suite reads
  `tests/default_aws_az_mappings.csv`, which lists regular availability zones only; an account that
  has not opted into Local Zones gets no mapping for them, and SkyPilot drops unmapped rows.

The snapshot rows are SkyPilot catalog rows copied as published (skyspot/pricing/pricing_data/SOURCE.md), so
they go back into SkyPilot's column layout unchanged: no count or price corrections of skyspot's own.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import os
import re
import sys
from pathlib import Path
from typing import Iterator

import pytest

from skyspot.pricing import prices as pricing

# Column layout of each cloud's vms.csv (sky/catalog/data_fetchers/fetch_{aws,gcp,azure}.py, 0.14.1).
# Columns the snapshot does not carry (disk, EFA, Azure image generation) stay empty; the optimizer
# reads none of them for a request without local disks.
CATALOG_COLUMNS = {
    "aws": [
        "InstanceType",
        "AcceleratorName",
        "AcceleratorCount",
        "vCPUs",
        "MemoryGiB",
        "GpuInfo",
        "Price",
        "SpotPrice",
        "Region",
        "AvailabilityZone",
        "Arch",
        "LocalDiskType",
        "NVMeSupported",
        "LocalDiskSize",
        "LocalDiskCount",
        "MaximumEfaInterfaces",
    ],
    "gcp": [
        "InstanceType",
        "vCPUs",
        "MemoryGiB",
        "AcceleratorName",
        "AcceleratorCount",
        "GpuInfo",
        "Region",
        "AvailabilityZone",
        "Price",
        "SpotPrice",
    ],
    "azure": [
        "InstanceType",
        "AcceleratorName",
        "AcceleratorCount",
        "vCPUs",
        "MemoryGiB",
        "GpuInfo",
        "Price",
        "SpotPrice",
        "Region",
        "Generation",
    ],
}
SKY_CLOUD_NAMES = {"aws": "AWS", "gcp": "GCP", "azure": "Azure"}

# skypilot-org/skypilot-catalog catalogs/v5/azure/images.csv as published (commit 58e5b17d9aae18888e40a263a4a64826dbfc9a43),
# header and rows. SkyPilot 0.14.1 downloads catalogs/v8's copy, which was not readable here; a v7-layout copy
# (op-devteam/machine-catalog catalogs/v7/azure/images.csv, tags renamed) maps gpu-ubuntu-2204 to the same image.
# SkyPilot reads Tag, Region and ImageId only (sky/catalog/common.py `get_image_id_from_tag_impl`).
AZURE_IMAGE_ROWS = (
    "Tag,Region,OS,OSVersion,ImageId",
    "skypilot:gpu-ubuntu-2204,,Ubuntu,22.04,microsoft-dsvm:ubuntu-hpc:2204:22.04.2023080201",
    "skypilot:k80-ubuntu-2004,,Ubuntu,20.04,microsoft-dsvm:ubuntu-2004:2004-gen2:21.08.30",
    "skypilot:v1-ubuntu-2004,,Ubuntu,20.04,microsoft-dsvm:ubuntu-2004:2004:21.11.04",
)

# A regular AWS availability zone ID (use1-az4). Local Zones (use1-atl2-az1) and Wavelength zones
# carry a location between the region code and the AZ number.
_AWS_AZ_ID = re.compile(r"^[a-z]+[0-9]+-az[0-9]+$")

# Modules that bind catalog paths when imported (module-level `common.read_catalog`).
_CATALOG_MODULES = (
    "sky.utils.accelerator_registry",
    "sky.catalog.aws_catalog",
    "sky.catalog.gcp_catalog",
    "sky.catalog.azure_catalog",
)

# Variables that would hand SkyPilot real (or another fixture's) cloud credentials, a remote API
# server, or another runtime directory.
_DROPPED_ENV_PREFIXES = ("AWS_", "GOOGLE_", "CLOUDSDK_", "AZURE_", "SKYPILOT_", "SKY_RUNTIME_DIR")


def snapshot_rows() -> list[dict[str, str]]:
    """The shipped snapshot as published rows (GCP VM and GPU rows still separate, as SkyPilot keeps them)."""
    with open(pricing.SNAPSHOT_PATH, newline="", encoding="utf-8") as f:
        return [r for r in csv.DictReader(f) if r["cloud"] in pricing.CLOUDS]


def write_catalog(catalog_dir: Path) -> None:
    """`<cloud>/vms.csv` for AWS, GCP and Azure and `common/accelerators.csv`, from the snapshot, and Azure's
    `images.csv` as published."""
    rows = snapshot_rows()
    for cloud, columns in CATALOG_COLUMNS.items():
        path = catalog_dir / cloud / "vms.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, columns, restval="")
            writer.writeheader()
            for r in rows:
                if r["cloud"] != cloud:
                    continue
                writer.writerow(
                    {
                        "InstanceType": r["instance_type"],
                        "AcceleratorName": r["accelerator_name"],
                        "AcceleratorCount": r["accelerator_count"],
                        "vCPUs": r["vcpus"],
                        "MemoryGiB": r["memory_gib"],
                        # GCP and Azure fetchers write the GPU name here; only `sky gpus list` parses it.
                        "GpuInfo": r["accelerator_name"],
                        "Price": r["price"],
                        "SpotPrice": r["spot_price"],
                        "Region": r["region"],
                        **({"AvailabilityZone": r["zone"]} if cloud != "azure" else {}),
                    }
                )
    (catalog_dir / "azure" / "images.csv").write_text("\n".join(AZURE_IMAGE_ROWS) + "\n", encoding="utf-8")
    # Which clouds offer each accelerator: read when SkyPilot canonicalises a GPU name.
    offered: dict[str, set[str]] = {}
    for r in rows:
        if r["accelerator_name"]:
            offered.setdefault(r["accelerator_name"], set()).add(SKY_CLOUD_NAMES[r["cloud"]])
    path = catalog_dir / "common" / "accelerators.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["AcceleratorName", "Clouds"])
        for name, clouds in sorted(offered.items()):
            writer.writerow([name, str(sorted(clouds))])


def aws_az_mappings():
    """Zone ID -> zone name for the snapshot's regular AWS zones, as `describe_availability_zones`
    returns them for an account that has not opted into Local Zones. Names are per account; these
    letter the IDs in order within each region."""
    import pandas as pd

    ids_by_region: dict[str, set[str]] = {}
    for r in snapshot_rows():
        if r["cloud"] == "aws" and _AWS_AZ_ID.match(r["zone"]):
            ids_by_region.setdefault(r["region"], set()).add(r["zone"])
    names, ids = [], []
    for region, zone_ids in sorted(ids_by_region.items()):
        for letter, zone_id in zip("abcdefghij", sorted(zone_ids)):
            names.append(region + letter)
            ids.append(zone_id)
    return pd.DataFrame({"AvailabilityZoneName": names, "AvailabilityZone": ids})


def _reload_catalog_modules() -> None:
    """Re-run the catalog modules' module-level code so their lazy frames bind the current catalog dir.

    `import sky` (done once per test session) fixes the paths of whatever catalog module was imported
    by then; reloading is what a fresh process with this HOME would have run."""
    from sky.utils import annotations

    for name in _CATALOG_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)
    # SkyPilot's API server clears these between requests (sky/server/common.py reload_for_new_request).
    annotations.clear_request_level_cache()


class ApiServerStarted(AssertionError):
    pass


@contextlib.contextmanager
def offline_skypilot(home: Path) -> Iterator[Path]:
    """SkyPilot with AWS, GCP and Azure enabled over the snapshot catalog under `home`; yields the catalog dir.

    On exit every patch is undone and the catalog modules are re-bound to the real HOME. An attempt
    to start SkyPilot's API server inside raises `ApiServerStarted`, and again on exit in case the
    caller swallowed it."""
    import sky
    from sky import check as sky_check
    from sky.catalog import common as catalog_common
    from sky.server import common as server_common
    from sky.skylet import constants, runtime_utils

    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(_DROPPED_ENV_PREFIXES):
                mp.delenv(name)
        mp.setenv("HOME", str(home))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")  # botocore never asks 169.254.169.254
        # The expression sky/catalog/common.py evaluated at import, evaluated again under this HOME.
        catalog_dir = Path(
            runtime_utils.get_runtime_dir_path(os.path.join(".sky/catalogs", constants.CATALOG_SCHEMA_VERSION))
        )
        write_catalog(catalog_dir)
        mp.setattr(catalog_common, "_ABSOLUTE_VERSIONED_CATALOG_DIR", str(catalog_dir))
        try:
            _reload_catalog_modules()
            from sky.catalog import aws_catalog

            enabled = [sky.clouds.AWS(), sky.clouds.GCP(), sky.clouds.Azure()]
            # The seam of SkyPilot's `enable_all_clouds`: what `sky check` cached as enabled. Without
            # credentials it would enable nothing. Prices, regions and placement stay SkyPilot's own.
            mp.setattr(sky_check, "get_cached_enabled_clouds_or_refresh", lambda *args, **kwargs: list(enabled))

            def _no_credential_checks(*args, **kwargs):
                raise AssertionError("SkyPilot asked the clouds for credentials (sky.check.check_capability)")

            # Unreached while every requested cloud is enabled; a tripwire, not a stand-in.
            mp.setattr(sky_check, "check_capability", _no_credential_checks)
            mappings = aws_az_mappings()
            # Also SkyPilot's seam: the account's zone map, which SkyPilot fetches from AWS with the
            # account's credentials (here its identity lookup fails for want of any, as it would).
            mp.setattr(aws_catalog, "_get_az_mappings", lambda aws_user_hash: mappings.copy())

            started = []

            def _no_api_server(*args, **kwargs):
                started.append(args)
                raise ApiServerStarted("SkyPilot tried to start its API server")

            mp.setattr(server_common, "_start_api_server", _no_api_server)
            yield catalog_dir
            if started:
                raise ApiServerStarted(f"SkyPilot tried to start its API server {len(started)} time(s)")
        finally:
            mp.undo()
            _reload_catalog_modules()
