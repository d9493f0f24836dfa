"""Which container images a node lets a job run: the operator's allow-list.

A custom trainer or sampler image (`openrl.trainer_backend=<image>`) is code the
operator did not write, so nothing runs unless the node's config names it:
`[workers] allowed_images` holds fnmatch patterns ("ghcr.io/acme/trainers/*",
"registry.local/openrld-lora:1.*"), and an empty list allows no image at all.
The match is case-sensitive (`fnmatchcase`), as image references are, and `*`
crosses `/`, so a pattern that ends in `/*` allows a whole repository path. An
operator who wants one exact, immutable image names its digest
("registry/team/trainer@sha256:...").
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from openrld.errors import BadRequest


def image_allowed(image: str, patterns: tuple[str, ...]) -> bool:
    """Whether `image` matches one of `patterns`; no patterns: no image is allowed."""
    return any(fnmatchcase(image, pattern) for pattern in patterns)


def check_image_allowed(image: str, patterns: tuple[str, ...], key: str = "openrl.trainer_backend") -> None:
    """Raise the job's 400 when this node may not run `image`.

    Raises:
        BadRequest: naming `key` (the job setting that named the image), the image,
            and the node setting that would allow it.
    """
    if image_allowed(image, patterns):
        return
    if not patterns:
        why = "this node allows no container images (its [workers] allowed_images is empty)"
    else:
        why = f"this node's workers.allowed_images ({', '.join(patterns)}) does not match it"
    raise BadRequest(
        f"{key}: image {image!r} is not allowed: {why}; the node's operator can add a pattern "
        "to workers.allowed_images",
        key=key,
    )
