import os
import sys

import torch

# Spawned ranks inherit sys.path, so helper modules in tests/ import there too.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
