"""What a command runs, as one call from the Python API: a frozen job object in, the work
done and its outcome out (`extract`). Runs in the user's process."""
