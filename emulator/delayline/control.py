"""The files through which a backend talks to a running delay line (in its run-state folder).

links.json holds the link changes in force ({"sequence": n, "links": [...]}); after SIGHUP the
delay line applies them and writes the sequence number to links.json.applied. counters.json is
the delay line's per-pair counters, rewritten about once a second.
"""

from pathlib import Path

LINKS_FILE = "links.json"
COUNTERS_FILE = "counters.json"


def links_path(folder: Path) -> Path:
    return Path(folder) / LINKS_FILE


def applied_path(links: Path) -> Path:
    """The acknowledgement file of a links file."""
    return Path(links).with_name(Path(links).name + ".applied")


def control_files(folder: Path) -> list[Path]:
    """Every control file (and its temporary) a delay line run may leave in `folder`."""
    links = links_path(folder)
    return [links, applied_path(links), links.with_name(links.name + ".tmp"), Path(folder) / COUNTERS_FILE,
            Path(folder) / (COUNTERS_FILE + ".tmp")]
