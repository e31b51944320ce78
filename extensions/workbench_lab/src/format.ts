/** Small formatters shared by the panel and the details view. */

export function duration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) {
    return '–';
  }
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const r = s % 60;
  return h ? `${h}h${String(m).padStart(2, '0')}m` : `${m}m${String(r).padStart(2, '0')}s`;
}

export function number(value: number | null | undefined, digits = 4): string {
  return value === null || value === undefined ? '–' : value.toPrecision(digits);
}

export function money(value: number | null | undefined, currency: string | null): string {
  if (value === null || value === undefined) {
    return '';
  }
  return `${value.toFixed(value < 1 ? 4 : 2)} ${currency || ''}`.trim();
}
