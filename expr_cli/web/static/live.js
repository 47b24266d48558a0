// The event stream: a `change` event each time the run's version moves (DESIGN 18); the
// page refetches what it shows, never reloads. EventSource reconnects by itself.

export function follow(path, onChange, onState) {
  const es = new EventSource(path);
  es.addEventListener("change", (ev) => {
    let data = {};
    try { data = JSON.parse(ev.data); } catch { data = {}; }
    onChange(data);
  });
  es.addEventListener("gone", () => { onState("run gone"); es.close(); });
  es.onopen = () => onState("live");
  es.onerror = () => onState("reconnecting");
  return es;
}
