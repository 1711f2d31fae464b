"""Print the options named after the first argument, with their values, out of a job's
'thomas-tune tune' options (the first argument, one string as in tools/gpu_jobs.txt):
    python3 tools/job_options.py "$args" --model --width --resolution
The other options of the job (its tuning options) are left out."""
import shlex
import sys

words, keep = shlex.split(sys.argv[1]), set(sys.argv[2:])
out = []
for opt, val in zip(words, words[1:]):
    if opt in keep:
        out += [opt, val]
print(shlex.join(out))
