"""A tuned profile: the file `tandem tune` writes and `tandem serve --config` reads.

One schema for both sides (pydantic), so the writer cannot produce what the reader
refuses. A profile is a mapping of `tandem serve` options (their long names, `-` or
`_`), plus three sections that are not options:

    profile:   what made it and when (for people; not read back)
    classes:   per traffic class SLOs: {interactive|batch: {slo-ttft-ms, slo-tpot-ms}}
    workload:  the traffic it was tuned for: the drift monitor's reference (router/drift.py)

YAML, or TOML by the file's suffix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

HEADER = "# tandem profile, made by `tandem tune`: use it with `tandem serve --config THIS_FILE`\n"


class ProfileError(ValueError):
    """A profile file tandem cannot use; the message names the file and the field."""


class Quantiles(BaseModel):
    model_config = ConfigDict(extra="forbid")
    p50: float = Field(gt=0)
    p90: float = Field(gt=0)


class Workload(BaseModel):
    """The traffic a profile was tuned for, one value per drift dimension."""

    model_config = ConfigDict(extra="forbid")
    prompt_tokens: Quantiles
    output_tokens: Quantiles
    arrival_rate: float = Field(gt=0, description="requests/s, as sent (per router)")
    prefix_hit_rate: float = Field(ge=0, le=1)
    batch_share: float = Field(ge=0, le=1)


class ClassSLOs(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    slo_ttft_ms: float | None = Field(default=None, alias="slo-ttft-ms", gt=0)
    slo_tpot_ms: float | None = Field(default=None, alias="slo-tpot-ms", gt=0)


class Profile(BaseModel):
    """The whole file; every key outside the three sections is a serve option."""

    model_config = ConfigDict(extra="allow")
    profile: dict[str, Any] | None = None
    classes: dict[Literal["interactive", "batch"], ClassSLOs] | None = None
    workload: Workload | None = None

    def serve_options(self) -> dict[str, Any]:
        """The options, keyed by argparse dest (`slo_ttft_ms`), the classes' SLOs among
        them (the batch class's as `batch_slo_*`)."""
        opts = {k.replace("-", "_"): v for k, v in (self.model_extra or {}).items()}
        for cls, slos in (self.classes or {}).items():
            for key, value in slos.model_dump(exclude_none=True).items():
                opts[("batch_" if cls == "batch" else "") + key] = value
        return opts

    def text(self) -> str:
        """As YAML, sections first, ready for `tandem serve --config`."""
        doc = self.model_dump(by_alias=True, exclude_none=True)
        return HEADER + yaml.safe_dump(doc, sort_keys=False)


def read_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        text = path.read_text()
        if path.suffix in (".toml", ".tml"):
            import tomllib

            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ProfileError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a mapping of options")
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(f"{path}: {field_errors(e)}") from None


def field_errors(e: ValidationError) -> str:
    """pydantic's errors as `where: what`, one per field."""
    return "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
