"""The EFA image of an AWS candidate, by its owner: Amazon's, never a look-alike.

SkyPilot 0.14.1 boots every EFA node (`network_tier: best` on an EFA instance type) from the newest
available AMI *named* "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20250808", with no
owner filter (sky/clouds/aws.py:108-112 `_EFA_IMAGE_NAME`, :168-195 `_get_efa_image_id`:
`describe_images(Filters=[name])`, newest `CreationDate` wins). Anyone can publish a public AMI of that
name ("whoAMI"), and once AWS deprecates the dated image a copy is the only match.

The task cannot pin Amazon's AMI instead: SkyPilot refuses a non-docker `image_id` beside
`network_tier: best` (sky/resources.py:1535-1565, raised by `Resources.validate`, which
`Task.validate` and the optimizer call: sky/task.py:538, sky/optimizer.py:1946), and without
`network_tier: best` it attaches no EFA at all (sky/clouds/aws.py:800-808). So at launch skyspot
resolves, per region an EFA candidate can land in, Amazon's own image (`Owners=["amazon"]`, newest
available by CreationDate) and SkyPilot's pick by its own rule; the fabric goes ahead only where they
are the same image, and the task carries the resolved ids (`SKYSPOT_EFA_IMAGES`) so every node, on
every recovery, checks the AMI it booted (trainer/nccl_env.py). Anything else is refused in one line.

boto3 is imported only when an AWS EFA candidate asks; nothing here runs for other candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from skyspot.errors import UsageError

EFA_IMAGE_NAME = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20250808"  # sky/clouds/aws.py:111-112
AMAZON = "amazon"  # the owner alias of Amazon's public AMIs (EC2 DescribeImages `Owners`)
IMAGES_ENV = "SKYSPOT_EFA_IMAGES"
"""The task's variable: {region: Amazon's EFA AMI id}, compact JSON, for the node's own check."""


@dataclass(frozen=True)
class EfaImage:
    """One region's EFA image: Amazon's, and the one SkyPilot's name-only lookup would boot."""

    region: str
    amazon: Optional[str]
    """Amazon's newest available AMI of the name, or None."""
    skypilot_pick: Optional[str]
    """The newest available AMI of the name from any owner (SkyPilot's rule), or None."""
    pick_owner: Optional[str] = None


def _newest(images: Iterable[dict[str, Any]]) -> Optional[dict[str, Any]]:
    available = [i for i in images if i.get("State") == "available" and i.get("Name") == EFA_IMAGE_NAME]
    return max(available, key=lambda i: i.get("CreationDate", ""), default=None)


def _clients() -> Callable[[str], Any]:
    """EC2 clients by region from one fresh session (today's credentials), made at the first client, inside
    efa_image's error handling (a missing AWS_PROFILE raises there). One session for every region: each new
    session reads EC2's service model from its JSON again, about 0.2 s of CPU a region."""
    session = None

    def client(region: str) -> Any:
        nonlocal session
        if session is None:
            import boto3

            session = boto3.session.Session()
        return session.client("ec2", region_name=region)

    return client


def efa_image(region: str, client_for: Optional[Callable[[str], Any]] = None) -> EfaImage:
    """Both lookups in `region`; raises UsageError (one line) when AWS cannot be asked."""
    try:
        import botocore.exceptions as bex
    except ImportError:  # pragma: no cover - boto3 is a dependency
        raise UsageError("the EFA image cannot be resolved: boto3 is not installed") from None
    name_filter = [{"Name": "name", "Values": [EFA_IMAGE_NAME]}]
    try:
        client = (client_for or _clients())(region)
        amazon = _newest(client.describe_images(Owners=[AMAZON], Filters=name_filter).get("Images", []))
        pick = _newest(client.describe_images(Filters=name_filter).get("Images", []))
    except (bex.NoCredentialsError, bex.ProfileNotFound, bex.PartialCredentialsError) as error:
        raise UsageError(
            f"the fabric on AWS needs Amazon's EFA image resolved at launch, and AWS credentials "
            f"are missing ({error}); configure them (`aws configure`) or drop "
            f"resources.network_tier"
        ) from None
    except (bex.BotoCoreError, bex.ClientError) as error:
        raise UsageError(
            f"the fabric on AWS: Amazon's EFA image in {region} could not be resolved ({str(error).splitlines()[0]})"
        ) from None
    return EfaImage(region, _field(amazon, "ImageId"), _field(pick, "ImageId"), _field(pick, "OwnerId"))


def _field(image: Optional[dict[str, Any]], key: str) -> Optional[str]:
    """One string field of an image describe_images returned; None without the image or the field."""
    value = (image or {}).get(key)
    return value if isinstance(value, str) else None


def resolve(regions: Iterable[str], client_for: Optional[Callable[[str], Any]] = None) -> dict[str, str]:
    """{region: Amazon's EFA AMI} for every region; UsageError (one line) where Amazon has none, or where
    SkyPilot's name-only lookup would boot another owner's image (it cannot be pinned: module doc)."""
    client_for = client_for or _clients()
    images: dict[str, str] = {}
    for region in sorted(set(regions)):
        found = efa_image(region, client_for)
        if found.amazon is None:
            raise UsageError(
                f"the fabric on AWS refused: no EFA image '{EFA_IMAGE_NAME}' owned by Amazon in "
                f"{region} (SkyPilot would boot whatever AMI has that name); drop "
                f"resources.network_tier or pin resources.regions elsewhere"
            )
        if found.skypilot_pick != found.amazon:
            raise UsageError(
                f"the fabric on AWS refused: in {region} the newest AMI named '{EFA_IMAGE_NAME}' is "
                f"{found.skypilot_pick} (owner {found.pick_owner}), not Amazon's {found.amazon}, and "
                f"SkyPilot 0.14.1 boots it by name (sky/clouds/aws.py:168-195); drop "
                f"resources.network_tier or pin resources.regions elsewhere"
            )
        images[region] = found.amazon
    return images


__all__ = ["AMAZON", "EFA_IMAGE_NAME", "IMAGES_ENV", "EfaImage", "efa_image", "resolve"]
