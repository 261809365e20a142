"""Where things live: the packaged configs (in the wheel: elasticflow/conf; in a checkout: ./conf), and a run's
checkpoints."""
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import ElasticFlowError


def conf_dir() -> Path:
    here = Path(__file__).resolve().parents[1]  # elasticflow/ (this file is elasticflow/_util/paths.py)
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"elasticflow's conf/ directory is missing next to {here}; reinstall the package")


def checkpoint_dir(cfg: Any, run_dir: Path) -> Path:
    """``checkpoint.dir`` (``~`` expanded), else RUN_DIR/checkpoints."""
    return Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def _private_group(gid: int) -> bool:
    """Whether nobody but this user is in group ``gid``: a user private group, as under a umask of 002, where
    Hydra's run directories come out group-writable."""
    import grp
    import pwd

    try:
        me = pwd.getpwuid(os.geteuid()).pw_name
        members = set(grp.getgrgid(gid).gr_mem) | {p.pw_name for p in pwd.getpwall() if p.pw_gid == gid}
    except KeyError:  # a gid without a name: nobody can say who is in it
        return False
    return members <= {me}


def refuse_if_shared(path: Path, what: str) -> None:
    """ElasticFlowError if ``path`` exists and another user owns it, or group or others may write into it (a
    sticky directory like /tmp aside, whose entries only their owner may replace). Whoever can write there can
    swap the files the job reads back (config.yaml names the model file the workers import) or plant symlinks
    where it appends."""
    try:
        st = os.stat(path)  # a symlink to a directory of one's own is fine: what matters is who writes there
    except FileNotFoundError:
        return
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    elif mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        problem = f"may be written by others (mode {mode:o})"
    elif mode & stat.S_IWGRP and not mode & stat.S_ISVTX and not _private_group(st.st_gid):
        problem = f"may be written by its group, which has other members (mode {mode:o})"
    else:
        return
    raise ElasticFlowError(f"the {what} {path} {problem}: whoever can write there can change what the job reads "
                           "back and run code as you",
                           f"use a directory of your own (chmod go-w {path}), or pass launcher.trust_shared_dirs=true "
                           "if everyone who can write there is trusted")
