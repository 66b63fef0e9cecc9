# Sourced by the serving scripts. start_server LOG [oscarkv serve arguments...]: starts `oscarkv serve` on port
# 8100 in the background (its output to LOG), sets $server to its pid, and returns once /health answers (exits,
# showing LOG, if the server dies first). It refuses to start while something already answers on that port, whose
# /health would otherwise pass for the new server's.
start_server() {
  local log=$1 health=http://127.0.0.1:8100/health; shift
  if curl -sf "$health" > /dev/null; then
    echo "something already answers on port 8100; stop it first"; exit 1
  fi
  oscarkv serve "$@" --port 8100 > "$log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    curl -sf "$health" > /dev/null && return 0
    kill -0 "$server" 2> /dev/null || { cat "$log"; exit 1; }
    sleep 1
  done
  echo "the server did not answer /health within 600 s"; cat "$log"; exit 1
}
