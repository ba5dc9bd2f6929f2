"""labkit: see distributed PyTorch training run, from a notebook or a terminal."""
from .config import RunConfig
from .dist import RankContext, cleanup, print0, reduce_scalar, rprint, session, setup
from .env import probe as env_probe
from .launch import LaunchCancelled, LaunchError, LaunchTimeout, RankError, launch

__version__ = "0.1.0"
